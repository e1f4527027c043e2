"""Configuration errors that name the YAML field, the module and the fix."""
from __future__ import annotations


class CPConfigError(ValueError):
    """A declaration problem found before any collective runs.

    The message always reads ``[<yaml field>] module '<fqn>': <problem>. Fix: <fix>`` (module
    and fix omitted where they do not apply), so a user can go straight to the YAML line.
    """

    def __init__(self, field: str, problem: str, *, module: str | None = None, fix: str | None = None):
        self.field = field
        self.module = module
        self.problem = problem
        self.fix = fix
        msg = f"[{field}]"
        if module is not None:
            msg += f" module '{module}':"
        msg += f" {problem}"
        if fix:
            msg += f". Fix: {fix}"
        super().__init__(msg)

    def __reduce__(self):  # picklable across ranks (keyword-only fields)
        return (_rebuild_config_error, (type(self), self.field, self.problem, self.module, self.fix))


def _rebuild_config_error(cls, field, problem, module, fix):
    return cls(field, problem, module=module, fix=fix)


class PreflightError(RuntimeError):
    """Raised on every rank when the preflight check failed on at least one rank."""
