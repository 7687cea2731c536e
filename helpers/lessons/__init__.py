"""What the notebooks import: one module per lesson, named by topic, and what several lessons share.

    from helpers.lessons.zero import check_step          # lesson 09's exercise check

Lesson modules: ``ranks`` and ``mp_spawn`` (00), ``collectives`` (01), ``ddp`` (02), ``dp_vs_ddp`` (03), ``amp`` (04),
``rpc`` (05), ``checkpoint`` and ``cluster`` (06), ``model_parallel`` (07), ``debugging`` (08), ``zero`` (09),
``mesh`` (10), ``scale`` (11). Shared: ``checks`` ("Correct:" / "Not yet:"), ``plots``, ``explorers`` (the sliders),
``system`` (the machine, cores, pinned versions). A lesson module may import the kit and the launcher's public API
(``helpers.launcher.api``), never the launcher's internals.
"""
