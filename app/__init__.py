"""The application floor: the ``emapg`` command (``app.cli`` dispatches to each package's ``main(argv)``),
``emapg demo`` (``app.demo``), ``emapg config`` (``app.config_cli``) and ``emapg models`` (``app.model_cli``).

It may import every package; no library module imports it (``tests/test_layering.py``). The core names its
entry module only as a string (``emapg.CLI_MODULE``) to launch servers in subprocesses.
"""
