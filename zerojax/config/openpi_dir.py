"""An openpi checkpoint directory as `model.init_from` names it (`params/`, an orbax tree, beside
`assets/<asset_id>/norm_stats.json`): its tree's shapes from orbax's metadata, its statistics,
and which family's tree it is, for the config's model keys and for `interop.openpi`. Generic:
the families' `OpenpiLayout`s say which heads are theirs. orbax (and jax) only when called."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import numpy as np

from zerojax.errors import ConfigError
from zerojax.models import registry

PARAMS, ASSETS, NORM_STATS = "params", "assets", "norm_stats.json"
INIT_DIR = "openpi_init"  # RUN_DIR/openpi_init/assets/<asset_id>/norm_stats.json
STATS = ("mean", "std", "q01", "q99")  # openpi's NormStats: mean and std required, the quantiles optional


def orbax_tree(params: Path):
    """orbax's metadata tree of a PyTree checkpoint (a dict in openpi's orbax, StepMetadata in newer
    ones), or ConfigError naming what is wrong with `params`. Read by orbax's handler itself: the
    Checkpointer around it turns a missing or unreadable _METADATA into warnings on the log (extra
    lines before the error) and an empty answer; the handler raises, and its few log lines are
    held back and folded into the error (`_orbax_log`)."""
    import orbax.checkpoint as ocp

    params = Path(params).absolute()  # orbax takes absolute paths only
    _check_files(params)
    handler = ocp.PyTreeCheckpointHandler()
    with _orbax_log() as said:
        try:
            meta = handler.metadata(params)
        except Exception as err:  # noqa: BLE001 - orbax fails in many ways on a directory that is not its own
            told = f"; orbax said: {said[0]}" if said else ""
            raise ConfigError(f"{params} is not an orbax checkpoint ({type(err).__name__}: "
                              f"{str(err).splitlines()[0][:160] if str(err) else ''}{told})") from None
        finally:
            handler.close()
    meta = getattr(meta, "item_metadata", meta)
    return getattr(meta, "tree", meta)


def _check_files(params: Path) -> None:
    """The files orbax's metadata reads first, checked before orbax opens them: an empty params/,
    one cut short (copied part way) or one whose _METADATA is not orbax's JSON. Checked here because
    tensorstore, asked for a manifest that is missing, keeps retrying on its threads and prints
    tracebacks after the error (measured with orbax 0.12.8, tensorstore 0.1.86)."""
    fix = "copy the checkpoint's params/ again, whole"
    try:
        empty = not any(params.iterdir())
    except OSError as err:
        raise ConfigError(f"{params} cannot be read ({type(err).__name__}: {err})") from None
    if empty:
        raise ConfigError(f"{params} is empty; an openpi checkpoint's params/ holds orbax's _METADATA and the "
                          f"arrays' files; {fix}")
    if not (params / "_METADATA").is_file():
        raise ConfigError(f"{params} has no _METADATA (orbax's record of the tree): not an orbax checkpoint, or "
                          f"one cut short; {fix}")
    try:
        doc = json.loads((params / "_METADATA").read_text())
        ocdbt, tree = doc.get("use_ocdbt", False), doc["tree_metadata"]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(f"{params}/_METADATA is not orbax's tree metadata (a JSON object with \"tree_metadata\"; "
                          f"{type(err).__name__}: {err}); {fix}") from None
    if not isinstance(tree, dict) or not tree:
        raise ConfigError(f"{params}/_METADATA lists no arrays (its \"tree_metadata\" is {tree!r}); {fix}")
    if ocdbt and not (params / "manifest.ocdbt").is_file():
        raise ConfigError(f"{params} has no manifest.ocdbt, the index of the arrays its _METADATA says are in one "
                          f"OCDBT database (use_ocdbt): cut short; {fix}")


@contextlib.contextmanager
def _orbax_log():
    """orbax's log records (absl's logger) at WARNING and above, held in the list it yields instead
    of reaching the user's terminal while a directory is probed."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logger, keep = logging.getLogger("absl"), Keep(logging.WARNING)
    propagate, logger.propagate = logger.propagate, False
    logger.addHandler(keep)
    try:
        yield said
    finally:
        logger.removeHandler(keep)
        logger.propagate = propagate


def flat_tree(tree, prefix: str = "") -> dict:
    """A nested dict's leaves by "/"-joined path, the root "params" and nnx's trailing "value" dropped."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        out.update(flat_tree(value, path) if isinstance(value, dict) else {path: value})
    if prefix:
        return out
    flat = {k.removeprefix(f"{PARAMS}/"): v for k, v in out.items()}
    if flat and all(k.endswith("/value") for k in flat):
        flat = {k.removesuffix("/value"): v for k, v in flat.items()}
    return flat


def tree_shapes(directory) -> dict:
    """openpi path -> shape of DIR/params (ConfigError if there is none, or it is not orbax's)."""
    params = Path(directory) / PARAMS
    if not params.is_dir():
        raise ConfigError(f"model.init_from={str(directory)!r}: no {PARAMS}/ directory; an openpi checkpoint holds "
                          f"its weights in {PARAMS}/ (an orbax tree) beside {ASSETS}/<asset_id>/{NORM_STATS}")
    tree = orbax_tree(params)
    try:
        shapes = {k: tuple(v.shape) for k, v in flat_tree(tree).items()}
    except (AttributeError, TypeError) as err:
        raise ConfigError(f"{params}: orbax's metadata is not a tree of arrays ({type(err).__name__}: {err})") from None
    if not shapes:
        raise ConfigError(f"{params}: an orbax checkpoint without parameters")
    return shapes


def read_assets(directory) -> dict:
    """{asset_id: {openpi key ("state", "actions"): {stat: float32 array}}} of DIR/assets
    (ConfigError if there are none, or a file is not openpi's `normalize.save`'s)."""
    assets = Path(directory) / ASSETS
    files = sorted(assets.rglob(NORM_STATS)) if assets.is_dir() else []
    if not files:
        raise ConfigError(f"model.init_from={str(directory)!r}: no {ASSETS}/<asset_id>/{NORM_STATS}; an openpi "
                          "checkpoint keeps its normalization statistics there, beside params/ (openpi's training "
                          "writes them with each step)")
    out = {}
    for path in files:
        try:
            doc = json.loads(path.read_text())["norm_stats"]
            out[str(path.parent.relative_to(assets))] = {
                key: {s: np.asarray(v[s], np.float32) for s in STATS if v.get(s) is not None} for key, v in doc.items()}
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError, ValueError) as err:
            raise ConfigError(f"{path} is not openpi's norm_stats.json ({{\"norm_stats\": {{\"state\": {{\"mean\": "
                              f"[...], \"std\": [...], ...}}}}}}: {type(err).__name__}: {err})") from None
        missing = [f"{key}.{s}" for key, v in out[str(path.parent.relative_to(assets))].items()
                   for s in ("mean", "std") if s not in v]
        if missing:
            raise ConfigError(f"{path}: no {', '.join(missing)} (openpi's NormStats requires mean and std)")
    return out


def family_of(shapes: dict, where: str, given: str | None) -> str:
    """The family whose heads the tree has; ConfigError if none, or if model.family says another."""
    layouts = registry.openpi_layouts()
    if given and given not in layouts:
        raise ConfigError(f"model.family={given}: no openpi layout; zerojax reads openpi's "
                          f"{', '.join(layouts)} trees")
    has = lambda head: any(k.startswith(head + "/") for k in shapes)  # noqa: E731
    found = [name for name, layout in layouts.items() if all(has(h) for h in layout.heads)]
    if not found:
        heads = "; ".join(f"{name}: {', '.join(layout.heads)}" for name, layout in layouts.items())
        raise ConfigError(f"{where}: an openpi tree of no family zerojax reads (their heads: {heads})")
    if given and given != found[0]:
        raise ConfigError(f"model.family={given}, but {where} is an openpi {found[0]} tree (it has "
                          f"{', '.join(layouts[found[0]].heads)}); set model.family={found[0]} or leave it out")
    return found[0]
