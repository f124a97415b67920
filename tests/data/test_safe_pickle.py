import os
import pickle
import struct

import numpy as np
import pytest

from flatbma.data import load_cifar10
from flatbma.data._readers import load_data_pickle
from flatbma.errors import FlatbmaError


class _RunsCommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _py2_bytes(value: bytes) -> bytes:
    return b"U" + bytes([len(value)]) + value  # SHORT_BINSTRING: a Python 2 str


def _py2_array(array: np.ndarray) -> bytes:
    """Pickle a 2-D uint8 array exactly as Python 2 numpy (cPickle, protocol 2) wrote the CIFAR files."""
    raw = array.tobytes()
    return (
        b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85" + _py2_bytes(b"b") + b"\x87R"
        b"(K\x01J" + struct.pack("<i", array.shape[0]) + b"J" + struct.pack("<i", array.shape[1]) + b"\x86"
        b"cnumpy\ndtype\n" + _py2_bytes(b"u1") + b"K\x00K\x01\x87R(K\x03" + _py2_bytes(b"|")
        + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89T" + struct.pack("<i", len(raw)) + raw + b"tb"
    )  # fmt: skip


def test_python2_style_batch_loads(tmp_path):
    data = (np.arange(2 * 3072) % 251).astype(np.uint8).reshape(2, 3072)
    body = _py2_bytes(b"data") + _py2_array(data) + _py2_bytes(b"labels") + b"](K\x03K\x07e"
    path = tmp_path / "batch"
    path.write_bytes(b"\x80\x02}(" + body + b"u.")
    record = load_data_pickle(path, source="")
    assert record[b"labels"] == [3, 7]
    np.testing.assert_array_equal(record[b"data"], data)


def test_os_system_pickle_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil"
    path.write_bytes(pickle.dumps({b"data": _RunsCommand(f"touch {marker}")}, protocol=2))
    with pytest.raises(FlatbmaError, match=r"refusing to load the global '(posix|os|nt)\.system'"):
        load_data_pickle(path, source="")
    assert not marker.exists()


@pytest.mark.parametrize(
    "payload",
    [
        b"\x80\x02cbuiltins\neval\nX\x04\x00\x00\x001+1\x85R.",
        b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00aX\x04\x00\x00\x00rot13\x86R.",
        b"\x80\x02cnumpy\nload\nX\x01\x00\x00\x00a\x85R.",
    ],
)
def test_other_globals_are_refused(tmp_path, payload):
    path = tmp_path / "evil"
    path.write_bytes(payload)
    with pytest.raises(FlatbmaError, match=r"not a plain data pickle"):
        load_data_pickle(path, source="")


def test_malicious_cifar_batch_is_refused(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    marker = tmp_path / "pwned"
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta"]:
        (folder / name).write_bytes(pickle.dumps(_RunsCommand(f"touch {marker}"), protocol=2))
    with pytest.raises(FlatbmaError, match=r"not a plain data pickle"):
        load_cifar10(tmp_path)
    assert not marker.exists()
