"""Puts the tests folder on sys.path (pytest's default import mode does it for a folder with a
conftest.py), so every test can import the shared helper config_helpers."""
