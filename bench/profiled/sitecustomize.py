"""Loaded by a server that bench/stream_profile.py starts: every thread runs under cProfile,
and each one's figures go to $SERVE_PROFILE_DIR when it ends (bench only: serve has no such
code)."""
import cProfile
import os
import threading

_run = threading.Thread.run


def _profiled_run(self):
    profile = cProfile.Profile()
    profile.enable()
    try:
        _run(self)
    finally:
        profile.disable()
        profile.dump_stats(os.path.join(os.environ["SERVE_PROFILE_DIR"],
                                        f"{self.name}-{threading.get_ident()}.prof"))


threading.Thread.run = _profiled_run
