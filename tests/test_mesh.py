"""The mesh is the shape the user asked for: a -1 fills what the other axis leaves."""

import pytest

from zerojax.parallel.mesh import MeshConfig, mesh_shape, shape_note


def shape(data=-1, replica=-1, devices=8, processes=1):
    return mesh_shape(MeshConfig(data=data, replica=replica), devices, "cpu", processes)


@pytest.mark.parametrize("data, replica, devices, processes, expected", [
    # mesh.data given, replica=-1: replicas fill the devices
    (8, -1, 8, 2, (1, 8)),  # 2 processes x 4 devices, one FSDP group over all 8 (was 2 x 8: an error)
    (4, -1, 8, 2, (2, 4)),
    (2, -1, 8, 2, (4, 2)),
    (4, -1, 8, 1, (2, 4)),
    (1, -1, 8, 1, (8, 1)),  # DDP over 8 devices; one device is mesh.replica=1 mesh.data=1
    (16, -1, 16, 4, (1, 16)),
    # mesh.replica given, data=-1: the data axis fills the devices
    (-1, 1, 8, 2, (1, 8)),
    (-1, 2, 8, 1, (2, 4)),
    (-1, 4, 8, 2, (4, 2)),
    (-1, 8, 8, 1, (8, 1)),
    # both -1: one replica per process, data = each process's devices (unchanged)
    (-1, -1, 8, 1, (1, 8)),
    (-1, -1, 8, 2, (2, 4)),
    (-1, -1, 16, 4, (4, 4)),
    # both given: exactly that, on the first replica x data devices
    (4, 1, 8, 1, (1, 4)),
    (1, 1, 8, 2, (1, 1)),
    (4, 2, 8, 2, (2, 4)),
])
def test_each_rule(data, replica, devices, processes, expected):
    assert shape(data, replica, devices, processes) == expected


@pytest.mark.parametrize("data, replica, devices, message", [
    (3, -1, 8, "mesh.data=3 does not divide the 8 cpu devices; choose mesh.data from 1, 2, 4, 8 "
               "(mesh.replica=-1 fills the rest)"),
    (5, -1, 12, "mesh.data=5 does not divide the 12 cpu devices; choose mesh.data from 1, 2, 3, 4, 6, 12"),
    (16, -1, 8, "mesh.data=16 needs 16 devices but only 8 cpu devices exist; choose mesh.data from 1, 2, 4, 8"),
    (-1, 3, 8, "mesh.replica=3 does not divide the 8 cpu devices; choose mesh.replica from 1, 2, 4, 8 "
               "(mesh.data=-1 fills the rest)"),
    (8, 2, 8, "mesh.replica=2 x mesh.data=8 needs 16 devices but only 8 cpu devices exist"),
])
def test_a_shape_that_does_not_fit_names_the_valid_choices(data, replica, devices, message):
    with pytest.raises(ValueError) as err:
        shape(data, replica, devices)
    assert message in str(err.value)
    assert "mesh.cpu_devices, now 8" in str(err.value)  # on CPU the device count is a setting too


def test_the_startup_line_says_when_the_shape_was_chosen_per_process():
    assert "one replica per process" in shape_note(MeshConfig(), processes=2)
    assert shape_note(MeshConfig(), processes=1) == ""  # one process: one replica, nothing to explain
    assert shape_note(MeshConfig(data=8), processes=2) == ""  # the user chose
