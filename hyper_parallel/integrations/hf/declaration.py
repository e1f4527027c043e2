"""``plan_overrides`` for the HF entry: the YAML trainer's declaration, as a list or a YAML file.

:func:`load_plan_overrides` accepts the list of dicts the YAML trainer's ``plan_overrides`` holds,
or a path to a YAML file that is either that list or a mapping with a ``plan_overrides`` key (a
whole ``hyper-train`` config works), and returns the parsed specs
(:func:`~hyper_parallel.distributed.plan.spec.parse_plan_overrides`). Nothing is guessed: an empty
declaration at cp > 1 is refused by the planner like the YAML trainer's.
"""
from __future__ import annotations

import os

from ...distributed.errors import CPConfigError
from ...distributed.plan.spec import parse_plan_overrides


def load_plan_overrides(value):
    """list of dicts | YAML path | None -> list of ModuleShardingSpec (module doc)."""
    if isinstance(value, (str, os.PathLike)):
        import yaml

        path = os.fspath(value)
        if not os.path.isfile(path):
            raise CPConfigError("plan_overrides", f"no such YAML file: {path!r}",
                                fix="pass the list of entries, or the path of a YAML file holding them")
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
        if isinstance(data, dict):
            if "plan_overrides" not in data:
                raise CPConfigError("plan_overrides", f"{path!r} is a mapping without a plan_overrides key",
                                    fix="write `plan_overrides:` followed by the entries")
            data = data["plan_overrides"]
        value = data
    return parse_plan_overrides(value)
