"""The GPU tier (tests/gpu/conftest.py). A package, so that its conftest is `gpu.conftest` and never
takes the place of tests/conftest.py as the module `conftest` that the CPU tests import helpers from."""
