"""Bad input is refused before anything is written, with errors that say what and where."""

import numpy as np
import pytest

import embeddings as E


@pytest.fixture
def table():
    return E.SimpleEmbedding(np.arange(40, dtype=np.float32).reshape(10, 4), name="users")


@pytest.mark.parametrize("bad,pos", [(10, 2), (-1, 2), (2**40, 2)])
def test_out_of_range_index_names_table_position_value(table, bad, pos):
    out = np.full((4, 4), 5.0, np.float32)
    with pytest.raises(IndexError, match=rf"users.*{bad}.*position {pos}"):
        E.lookup_into(out, table, np.array([0, 1, bad, 3]))
    assert (out == 5.0).all()  # nothing written


def test_out_of_range_in_fixed_width_names_2d_position(table):
    with pytest.raises(IndexError, match=r"users: index 99 at position \(1, 0\)"):
        E.lookup(table, np.array([[0, 1], [99, 2]]))


def test_out_of_range_update_changes_nothing(table):
    before = table.data.copy()
    with pytest.raises(IndexError, match="users"):
        E.pullback(table, np.ones((3, 4), np.float32), [1, 2, 10], optimizer=E.SGD(1.0))
    assert np.array_equal(table.data, before)


@pytest.mark.parametrize("offsets", [[0, 3, 2, 4], [0, 2, 3], [1, 2, 4], [0, 2, 5], []])
def test_bad_offsets_raise_value_error(table, offsets):
    out = np.full((max(len(offsets) - 1, 0), 4), 5.0, np.float32)
    with pytest.raises(ValueError):
        E.lookup_into(out, table, np.array([0, 1, 2, 3]), np.array(offsets, np.int64))
    assert (out == 5.0).all()


@pytest.mark.parametrize("indices", [np.array([0.0, 1.0]), np.array([True, False])])
def test_non_integer_indices_raise_type_error(table, indices):
    with pytest.raises(TypeError):
        E.lookup(table, indices)


def test_non_float_table_raises_type_error():
    with pytest.raises(TypeError):
        E.SimpleEmbedding(np.zeros((3, 2), np.int32))


def test_non_float_weights_and_wrong_output_refused(table):
    with pytest.raises(TypeError):
        E.lookup(table, [[1, 2]], weights=[[1, 2]])
    with pytest.raises(TypeError):
        E.lookup_into(np.zeros((1, 4), np.float64), table, [[1, 2]])
    with pytest.raises(ValueError):
        E.lookup_into(np.zeros((2, 4), np.float32), table, [[1, 2]])


def test_bad_mode_and_shape(table):
    with pytest.raises(ValueError):
        E.lookup(table, [[1, 2]], mode="max")
    with pytest.raises(ValueError):
        E.lookup(table, [1, 2], mode="sum")  # pooled without bags
    with pytest.raises(ValueError):
        E.SimpleEmbedding(np.zeros(5, np.float32))
    with pytest.raises(ValueError):
        E.SimpleEmbedding(np.zeros((5, 4), np.float32).T)


def test_read_only_table_cannot_be_updated():
    data = np.zeros((4, 2), np.float32)
    data.setflags(write=False)
    t = E.SimpleEmbedding(data)
    assert np.array_equal(E.lookup(t, [1]), [[0, 0]])
    with pytest.raises(ValueError, match="read-only"):
        E.pullback(t, np.ones((1, 2), np.float32), [1], optimizer=E.SGD(1.0))


def test_non_finite_learning_rate_refused(table):
    with pytest.raises(ValueError):
        E.pullback(table, np.ones((1, 4), np.float32), [1], optimizer=E.SGD(float("nan")))
