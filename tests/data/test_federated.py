"""FederatedData: its layout's checks at construction (a label outside the classes, rows
outside x), before anything trains on them."""

import numpy as np
import pytest

from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.data.natural import Task


def _data(y, num_classes, task=None):
    x = np.zeros((len(y), 3), np.float32)
    return FederatedData.from_arrays(x, np.asarray(y), [np.arange(0, 2)], [np.arange(2, len(y))],
                                     num_classes=num_classes, task=task)


def test_labels_must_be_classes_of_the_dataset():
    assert _data([0, 2, 1], 3).num_classes == 3
    with pytest.raises(ValueError, match=r"label 3 is outside the 3 classes .* 0 … 2"):
        _data([0, 3, 1], 3)                     # past the model's outputs: trained without error
    with pytest.raises(ValueError, match=r"label -1 is outside the 3 classes"):
        _data([0, -1, 1], 3)
    with pytest.raises(ValueError, match="integer class ids"):
        _data([0.0, 0.5, 1.0], 3)


def test_a_multilabel_task_pads_its_tags_with_minus_one():
    task = Task(kind="multilabel", num_classes=4, inputs="features")
    y = np.array([[0, 3, -1], [1, -1, -1], [2, 1, 0]])
    x = np.zeros((3, 2), np.float32)
    data = FederatedData.from_arrays(x, y, [np.arange(2)], [np.arange(2, 3)], num_classes=4,
                                     task=task)
    assert data.y.shape == (3, 3)
    with pytest.raises(ValueError, match=r"label 4 is outside the 4 classes .* -1 … 3"):
        FederatedData.from_arrays(x, np.where(y == 3, 4, y), [np.arange(2)], [np.arange(2, 3)],
                                  num_classes=4, task=task)


def test_from_arrays_copies_only_the_kept_clients_samples():
    """keep: the kept clients' train and test blocks hold their samples (worked by hand), the
    others' rows are zero; labels and the splits are those of the whole dataset."""
    x = np.arange(1, 13, dtype=np.float32).reshape(6, 2)          # rows 1..6: [2r-1, 2r]
    y = np.array([0, 1, 2, 0, 1, 2], np.int32)
    train, test = [np.array([4, 0]), np.array([2]), np.array([5])], [np.array([1]), np.array([3]), np.array([], int)]
    data = FederatedData.from_arrays(x, y, train, test, num_classes=3, device=False,
                                     keep=np.array([False, True, True]))
    # layout: train c0 (rows 4, 0), c1 (2), c2 (5); test c0 (1), c1 (3)
    np.testing.assert_array_equal(data.x, [[0, 0], [0, 0], [5, 6], [11, 12], [0, 0], [7, 8]])
    np.testing.assert_array_equal(data.y, [1, 0, 2, 2, 1, 0])
    np.testing.assert_array_equal(np.asarray(data.clients.train_count), [2, 1, 1])
    with pytest.raises(ValueError, match="keep must be a bool per client"):
        FederatedData.from_arrays(x, y, train, test, num_classes=3, device=True,
                                  keep=np.array([True, True, True]))
