"""``load_npy``: the golden self-test's reader, called from several daemons' threads in one process."""

import threading

import numpy as np
import pytest

from agent._util.npy import load_npy


def test_threads_read_the_same_arrays_they_would_alone(tmp_path):
    paths = []
    for i in range(4):
        path = str(tmp_path / ("case%d.npy" % i))
        np.save(path, np.arange(12, dtype=np.float32).reshape(1, 3, 4) * i)
        paths.append(path)
    results, errors = [], []

    def read_all():
        try:
            for _ in range(50):
                results.append([float(load_npy(p).sum()) for p in paths])
        except Exception as exc:  # noqa: BLE001 - any failure in a thread is the finding
            errors.append(exc)

    threads = [threading.Thread(target=read_all) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == [] and len(results) == 300
    assert all(r == [0.0, 66.0, 132.0, 198.0] for r in results)


def test_a_pickled_array_is_refused_not_unpickled(tmp_path):
    path = str(tmp_path / "objects.npy")
    np.save(path, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="allow_pickle"):
        load_npy(path)
