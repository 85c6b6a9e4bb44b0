"""The errors zerojax raises on purpose, which the CLI recognises by class (docs/design.md §4).

    ConfigError       bad input: one `zerojax: error:` line, exit code 2, nothing written
    DistributedError  the processes of a run could not form (or keep) one mesh: exit code 1
    TrainingError     the run cannot go on (gradients stayed non-finite): exit code 1

Anything else (a bug, in zerojax or in a user's model) keeps its traceback. This module imports
nothing, so every layer may raise these.
"""


class ConfigError(ValueError):
    """Bad input: a config key, value, file or checkpoint that cannot be used as given."""


class DistributedError(RuntimeError):
    """The processes of a run could not form (or keep) one mesh."""


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. gradients stayed non-finite); what was written stays."""
