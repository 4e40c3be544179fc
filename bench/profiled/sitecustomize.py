"""Loaded by a server that bench/stream_profile.py starts: every thread runs under cProfile,
and each one's figures go to $SERVE_PROFILE_DIR when it ends (bench only: serve has no such
code)."""
import cProfile
import os
import threading

# Wrapped below run(), which thread classes of serve's own (the stream's writer) override.
_bootstrap = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]


def _profiled(self):
    profile = cProfile.Profile()
    profile.enable()
    try:
        _bootstrap(self)
    finally:
        profile.disable()
        profile.dump_stats(os.path.join(os.environ["SERVE_PROFILE_DIR"],
                                        f"{self.name}-{threading.get_ident()}.prof"))


threading.Thread._bootstrap_inner = _profiled  # type: ignore[attr-defined]
