"""distgrad's test suite, a package: test modules, the multi-rank drivers (``tests.dist``) and
the helpers they share import each other as ``tests.<module>`` (pytest puts the repository root
on ``sys.path``: ``pythonpath`` in pyproject.toml; the drivers run as ``python -m tests.dist.<name>``
from the repository root, see :func:`tests.helpers.launch`)."""
