"""A launcher of the tests only, ``hydra/launcher=subprocess``: the sweep driver on
:class:`subprocess_backend.SubprocessBackend` (tests/plugins on PYTHONPATH finds both)."""
