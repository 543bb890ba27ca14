"""``python -m cp_lightning.plan``: the layout planner (cp_lightning/planner/). A ``__main__`` module of its own,
so the package (the engine's CP plans) is imported once, not a second time as ``__main__``."""

from cp_lightning.planner.cli import main

raise SystemExit(main())
