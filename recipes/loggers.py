"""The optional loggers: TensorBoard and Weights & Biases come with ``pip install cp-lightning[loggers]``.

:func:`check_logger_packages` runs before the Trainer is built, so a config naming a logger whose package is
missing stops with the install command instead of Lightning's import error deep in the set-up.
"""

from __future__ import annotations

import importlib.util

# logger class name -> the packages it needs (any one of them)
PACKAGES = {"TensorBoardLogger": ("tensorboard", "tensorboardX"), "WandbLogger": ("wandb",)}
INSTALL = "pip install 'cp-lightning[loggers]'"


def _class_paths(logger) -> list[str]:
    """The class paths in a parsed ``trainer.logger`` value (one, a list, a bool or None)."""
    if logger is None or isinstance(logger, bool):
        return []
    if isinstance(logger, list | tuple):
        return [path for item in logger for path in _class_paths(item)]
    if isinstance(logger, str):
        return [logger]
    path = logger.get("class_path") if hasattr(logger, "get") else getattr(logger, "class_path", None)
    return [path] if path else [type(logger).__name__]


def check_logger_packages(logger) -> None:
    """Raise ModuleNotFoundError naming the extra to install when a configured logger's package is missing."""
    for path in _class_paths(logger):
        name = str(path).rsplit(".", 1)[-1]
        needed = PACKAGES.get(name)
        if needed and not any(importlib.util.find_spec(package) for package in needed):
            raise ModuleNotFoundError(
                f"trainer.logger {name} needs the {' or '.join(needed)} package, which is not installed: run "
                f"{INSTALL} (TensorBoard and Weights & Biases), or choose another logger (the configs' CSVLogger)."
            )
