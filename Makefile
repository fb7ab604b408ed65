# cuteaot: `make kernels` installs and builds the default bundle; `make test` runs the tests.
PYTHON ?= python3
SPEC ?= specs/qwen3-30b-a3b.yaml
OUT ?= generated
PIP := $(PYTHON) -m pip install -q --disable-pip-version-check

.PHONY: kernels test test-gpu install clean

# Installs only when pyproject.toml changed; torch first, from the cached CPU wheel
# where none is installed (a GPU machine keeps its own torch).
.install.stamp: pyproject.toml
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) torch==2.13.0
	$(PIP) -e '.[codegen,test]'
	touch $@

install: .install.stamp

kernels: .install.stamp
	$(PYTHON) -m cuteaot.codegen.cli build $(SPEC) --out $(OUT)

test: .install.stamp
	$(PYTHON) -m pytest -q

# GPU tests need generated/tiny, built here (`make kernels SPEC=specs/tiny.yaml`) and
# carried to the GPU machine, which needs only torch + cuda-bindings + this package.
test-gpu:
	$(PYTHON) -m pytest -q -m gpu --timeout=300 tests

clean:
	rm -rf $(OUT) .install.stamp
