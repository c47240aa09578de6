# Two set-up commands: `make demo` (the main job on the embedded default) and `make test`.
# Both create .venv when missing and install the project once; re-running skips work already done.

VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

demo: $(STAMP)
	VENV=$(VENV) scripts/demo.sh

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	VENV=$(VENV) PYTHON=$(PYTHON) scripts/install.sh
	touch $(STAMP)

clean:
	rm -rf $(VENV) outputs
