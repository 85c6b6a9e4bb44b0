import jax
import numpy as np
import pytest

from zerojax import data
from zerojax.parallel import mesh


def test_stdlib_corpus_is_python_source():
    corpus = data.load_corpus("stdlib", 0.1, 128)
    assert corpus.vocab_size == 256 and corpus.train.dtype == np.uint8
    assert len(corpus.train) > 1_000_000
    assert b"def " in corpus.train[:100_000].tobytes()
    assert len(corpus.val) == int((len(corpus.train) + len(corpus.val)) * 0.1)


def test_same_seed_and_step_same_batch_and_rows_are_consistent():
    tokens = np.arange(10_000, dtype=np.uint16)
    a = data.batch_rows(tokens, 16, seed=3, stream=data.TRAIN, step=7, global_batch=8)
    b = data.batch_rows(tokens, 16, seed=3, stream=data.TRAIN, step=7, global_batch=8)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (8, 17) and a.dtype == np.int32
    np.testing.assert_array_equal(np.diff(a, axis=1), 1)  # contiguous windows of the stream
    rows = data.batch_rows(tokens, 16, seed=3, stream=data.TRAIN, step=7, global_batch=8, rows=slice(2, 6))
    np.testing.assert_array_equal(rows, a[2:6])  # a process reads its rows of the same batch
    assert not np.array_equal(a, data.batch_rows(tokens, 16, 3, data.TRAIN, 8, 8))
    assert not np.array_equal(a, data.batch_rows(tokens, 16, 4, data.TRAIN, 7, 8))
    assert not np.array_equal(a, data.batch_rows(tokens, 16, 3, data.EVAL, 7, 8))


def test_train_and_validation_windows_are_disjoint(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, np.arange(5_000, dtype=np.uint16))
    corpus = data.load_corpus(str(path), 0.2, 32)
    assert corpus.vocab_size == 5_000
    boundary = len(corpus.train)
    for step in range(20):
        train = data.batch_rows(corpus.train, 32, 0, data.TRAIN, step, 16)
        val = data.batch_rows(corpus.val, 32, 0, data.EVAL, step, 16)
        assert train.max() < boundary <= val.min()


def test_token_files(tmp_path):
    tokens = (np.arange(3_000) * 7 % 1000).astype(np.uint16)
    tokens.tofile(tmp_path / "train.bin")  # nanoGPT's format: raw uint16
    np.save(tmp_path / "train.npy", tokens)
    (tmp_path / "train.txt").write_bytes(bytes(range(256)) * 10)
    for name in ("train.bin", "train.npy"):
        corpus = data.load_corpus(str(tmp_path / name), 0.1, 16)
        np.testing.assert_array_equal(np.concatenate([corpus.train, corpus.val]), tokens)
        assert corpus.vocab_size == 1000
    assert data.load_corpus(str(tmp_path / "train.txt"), 0.1, 16).vocab_size == 256


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "no such file"),
    (lambda p: p.write_bytes(b"tiny"), r"fewer than model\.seq_len\+2"),
])
def test_bad_sources(tmp_path, make, message):
    path = tmp_path / "corpus.txt"
    make(path)
    with pytest.raises(ValueError, match=message):
        data.load_corpus(str(path), 0.1, 16)


class AsProcess:
    """A sharding as process `index` of `count` would see it: JAX numbers devices process by
    process, so that process addresses the index-th contiguous block of `jax.devices()`."""

    def __init__(self, sharding, index, count):
        per = len(jax.devices()) // count
        self.sharding, self.local = sharding, set(jax.devices()[index * per : (index + 1) * per])

    def addressable_devices_indices_map(self, shape):
        return {d: i for d, i in self.sharding.devices_indices_map(shape).items() if d in self.local}


@pytest.mark.parametrize("processes", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", [(1, 8), (2, 4), (4, 2), (8, 1)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_process_rows_cover_the_local_devices(shape, processes):
    sharding = mesh.batch_sharding(mesh.make_mesh(mesh.MeshConfig(replica=shape[0], data=shape[1])))
    batch = 16
    for p in range(processes):
        rows = data.process_rows(AsProcess(sharding, p, processes), batch)
        # the batch is split over every device in order, so process p of P holds its P-th of the rows
        assert rows == slice(p * batch // processes, (p + 1) * batch // processes)
    assert data.process_rows(sharding, batch) == slice(0, batch) and jax.process_count() == 1  # this process
