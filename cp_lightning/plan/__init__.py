"""CP plans: data that says where a model's sequence is split and where it is gathered back.

A plan uses diffusers' ``_cp_plan`` vocabulary::

    {module_path: {arg_name_or_output_index: ContextParallelInput | [ContextParallelInput, ...]}
                  | ContextParallelOutput | [ContextParallelOutput | None, ...]}

``""`` names the root module and ``*`` matches every item of a ModuleList. A string key names a
``forward`` argument (passed by keyword or by position) split before the call; an integer key names
an item of the module's output split after the call (``split_output=True``, e.g. RoPE tables).
:func:`resolve_plan` validates a plan against a module without touching any process group;
:func:`apply_plan` installs the hooks and :func:`remove_plan` takes them off again.
"""

from cp_lightning.plan.hooks import apply_plan, remove_plan
from cp_lightning.plan.resolve import (
    JointInput,
    PerTokenInput,
    ResolvedEntry,
    Unsplit,
    check_loss_parallel,
    default_plan,
    resolve_plan,
    unsplit_paths,
)

__all__ = [
    "apply_plan",
    "remove_plan",
    "ResolvedEntry",
    "JointInput",
    "PerTokenInput",
    "Unsplit",
    "unsplit_paths",
    "default_plan",
    "resolve_plan",
    "check_loss_parallel",
]
