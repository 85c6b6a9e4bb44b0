"""Closed-loop simulation: a policy run (or a scripted expert) driving a simulated robot, scored
by the environment's own success signal (`zerojax rollout`, docs/design.md "Closed loop"), and
the scripted expert's episodes written as a LeRobot dataset (`zerojax collect`).

    metaworld.py  Meta-World's tasks as zerojax observes them: one camera and the state in,
                  4 actions out; the scripted expert; LeRobot's instruction for each task
    collect.py    the expert's episodes as a LeRobot v3.0 dataset (Parquet, AV1 videos, statistics)
    rollout.py    seeded episodes, action chunks executed n_action_steps at a time, success
                  per task, MP4s of a few episodes
    video.py      MP4 files written with PyAV (rollout videos, the collected datasets' cameras)

Simulation needs the `sim` extra (metaworld, mujoco) and an OpenGL that renders without a
display (OSMesa: Debian's libosmesa6): `require` checks both, so that nothing here is imported
by `import zerojax`.
"""

import os

from zerojax.errors import ConfigError

EXTRA = ("mujoco", "metaworld")


def require(command: str = "rollout") -> None:
    """ConfigError naming the install command where the sim extra or OSMesa is missing (`command`:
    the zerojax command that asked). MuJoCo renders through OSMesa unless MUJOCO_GL names another
    backend (egl on a GPU machine)."""
    import importlib
    import importlib.util
    import sys

    os.environ.setdefault("MUJOCO_GL", "osmesa")
    os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])
    # Both packages' presence first: a missing extra is named as such even where OSMesa is missing
    # too (importing mujoco is what finds its GL library absent).
    for name in EXTRA:
        installed = sys.modules[name] is not None if name in sys.modules else importlib.util.find_spec(name) is not None
        if not installed:
            raise _missing(name, command)
    for name in EXTRA:
        try:
            importlib.import_module(name)
        except ImportError:  # one of its own dependencies
            raise _missing(name, command) from None
        except Exception as err:  # mujoco's GL loader raises on import where OSMesa is missing
            raise ConfigError(f"{name} does not load ({type(err).__name__}: {err}); MUJOCO_GL="
                              f"{os.environ['MUJOCO_GL']} needs its library (OSMesa: apt-get install libosmesa6)") from None


def _missing(name: str, command: str) -> ConfigError:
    return ConfigError(f"zerojax {command} needs the {name} package (the sim extra): pip install 'zerojax[sim]'")
