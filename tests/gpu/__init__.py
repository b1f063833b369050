"""GPU tests (marker `gpu`); see conftest.py."""
