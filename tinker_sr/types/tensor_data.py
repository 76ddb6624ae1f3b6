"""TensorData: a typed, optionally CSR-sparse tensor, stored as a numpy array.

torch is imported only inside the torch conversions, so importing the types stays cheap.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .tensor_dtype import TensorDtype

if TYPE_CHECKING:
    import torch

__all__ = ["TensorData", "check_int64"]

_NUMPY_DTYPES: dict[str, type[np.generic]] = {"int64": np.int64, "float32": np.float32}

MAX_DENSE_CELLS = 1 << 31
"""Most cells ``to_numpy`` densifies a CSR tensor to (16 GiB at int64), a last line of
defence; request validation holds sparse tensors to the model's much smaller limits first."""


@dataclass(frozen=True, eq=False, init=False)
class TensorData:
    """A tensor in one of the two wire dtypes.

    Dense: ``data`` holds every value (row-major) and ``shape`` the dense shape.
    Sparse CSR (``sparse_crow_indices`` set): ``data`` holds only the listed values, every
    other cell takes the ``pad_value`` given when densifying; ``shape`` is required.
    Equality is identity (``eq=False``), as in the official SDK.
    """

    dtype: TensorDtype

    shape: list[int] | None = None
    """Dense shape; ``None`` means 1-D of ``len(data)``."""

    sparse_crow_indices: list[int] | None = None
    """CSR row pointers (``rows + 1`` entries)."""

    sparse_col_indices: list[int] | None = None
    """CSR column index of every listed value (``nnz`` entries)."""

    # No default, as in the SDK; __init__ is custom so the ordering rule does not apply.
    _numpy: np.ndarray = field(repr=False)  # type: ignore[misc]

    def __init__(
        self,
        data: list[int] | list[float] | np.ndarray | None = None,
        dtype: TensorDtype | None = None,
        shape: list[int] | None = None,
        sparse_crow_indices: list[int] | None = None,
        sparse_col_indices: list[int] | None = None,
    ) -> None:
        if dtype is None:
            raise TypeError("TensorData requires `dtype`")
        np_dtype = _numpy_dtype(dtype)
        if data is None:
            arr = np.empty(0, dtype=np_dtype)
        else:
            arr = _as_array(data, np_dtype)
        if sparse_crow_indices is None and shape is not None and list(arr.shape) != shape:
            _check_shape(shape)
            try:
                arr = arr.reshape(shape)
            except ValueError:
                raise ValueError(
                    f"TensorData: shape {shape} needs {math.prod(shape)} values, data has "
                    f"{arr.size}"
                ) from None
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "sparse_crow_indices", sparse_crow_indices)
        object.__setattr__(self, "sparse_col_indices", sparse_col_indices)
        object.__setattr__(self, "_numpy", arr)

    @property
    def data(self) -> list[int] | list[float]:
        """Stored values as a flat Python list (for CSR: only the listed values)."""
        return self._numpy.ravel().tolist()

    @property
    def is_sparse(self) -> bool:
        return self.sparse_crow_indices is not None

    @classmethod
    def from_numpy(cls, array: npt.NDArray[Any]) -> TensorData:
        """Float arrays become float32, signed-int arrays int64; other kinds are refused."""
        return cls(data=array, dtype=_tensor_dtype_of_numpy(array.dtype), shape=list(array.shape))

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> TensorData:
        import torch

        if tensor.dtype == torch.bfloat16:
            # numpy has no bfloat16; float32 holds every bfloat16 value exactly.
            tensor = tensor.float()
        return cls.from_numpy(tensor.detach().cpu().contiguous().numpy())

    @classmethod
    def from_torch_sparse(cls, tensor: torch.Tensor, pad_value: int = 0) -> TensorData:
        """CSR-encode a 2-D tensor, leaving out cells equal to ``pad_value``.

        Falls back to dense when the tensor is not 2-D or CSR would not be smaller:
        CSR costs ``(rows + 1) + 2 * nnz`` numbers against ``rows * cols`` dense.
        """
        import torch

        pad_value = _check_pad_value(pad_value)
        if tensor.ndim != 2:
            return cls.from_torch(tensor)
        tensor = tensor.detach().cpu()
        # torch's CSR treats 0 as the implicit value, so shift by pad_value and back.
        shifted = tensor - pad_value if pad_value != 0 else tensor
        rows, cols = tensor.shape
        nnz = int(shifted.count_nonzero().item())
        if (rows + 1) + 2 * nnz >= rows * cols:
            return cls.from_torch(tensor)
        with _quiet_csr_beta_warning():
            csr = shifted.to_sparse_csr()
        values = csr.values()
        if pad_value != 0:
            values = values + pad_value
        if values.dtype == torch.bfloat16:
            values = values.float()
        return cls(
            data=values.numpy(),
            dtype="float32" if tensor.dtype.is_floating_point else "int64",
            shape=[rows, cols],
            sparse_crow_indices=csr.crow_indices().tolist(),
            sparse_col_indices=csr.col_indices().tolist(),
        )

    @property
    def dense_size(self) -> int:
        """Number of cells of the dense tensor: what ``to_numpy`` allocates for CSR. Check it
        against a limit before densifying a tensor someone else sent."""
        if self.shape is None:
            return int(self._numpy.size)
        return math.prod(self.shape)

    def to_numpy(self, pad_value: int = 0) -> npt.NDArray[Any]:
        """Dense numpy array; CSR cells not listed are filled with ``pad_value``."""
        if self.sparse_crow_indices is None:
            return self._numpy
        pad_value = _check_pad_value(pad_value)
        crow, col, shape = self._csr_parts()
        if self.dense_size > MAX_DENSE_CELLS:
            raise ValueError(
                f"sparse TensorData of shape {shape} would densify to {self.dense_size} cells, "
                f"more than {MAX_DENSE_CELLS}; send a smaller tensor"
            )
        dense = np.full(shape, pad_value, dtype=self._numpy.dtype)
        rows = np.repeat(np.arange(len(crow) - 1), np.diff(crow))
        dense[rows, col] = self._numpy.ravel()
        return dense

    def to_torch(self, pad_value: int = 0) -> torch.Tensor:
        """Dense torch tensor (int64 or float32); CSR cells not listed get ``pad_value``."""
        try:
            import torch
        except ImportError as exc:
            raise ImportError("PyTorch is not installed. Cannot convert to torch tensor.") from exc
        if self.sparse_crow_indices is None:
            return torch.from_numpy(self._numpy)
        return torch.from_numpy(self.to_numpy(pad_value))

    def tolist(self, pad_value: int = 0) -> list[Any]:
        """Nested Python lists in the dense shape."""
        return self.to_numpy(pad_value).tolist()

    def check_sparse(self) -> None:
        """Raise ValueError if this is a malformed CSR tensor (cheap: never densifies).
        Construction does not check, as in the official SDK; request validation does."""
        if self.sparse_crow_indices is not None:
            self._csr_parts()

    def _csr_parts(self) -> tuple[np.ndarray, np.ndarray, list[int]]:
        if self.sparse_col_indices is None:
            raise ValueError("sparse TensorData needs sparse_col_indices with sparse_crow_indices")
        if self.shape is None or len(self.shape) != 2:
            raise ValueError(f"sparse TensorData needs a 2-D shape, got shape={self.shape}")
        _check_shape(self.shape)
        crow = np.asarray(self.sparse_crow_indices, dtype=np.int64)
        col = np.asarray(self.sparse_col_indices, dtype=np.int64)
        rows, cols = self.shape
        nnz = self._numpy.size
        if (
            len(crow) != rows + 1
            or crow[0] != 0
            or crow[-1] != nnz
            or np.any(np.diff(crow) < 0)
            or len(col) != nnz
            or (nnz and (col.min() < 0 or col.max() >= cols))
        ):
            raise ValueError(
                f"invalid CSR TensorData: shape={self.shape}, {len(crow)} row pointers "
                f"(need {rows + 1}, from 0 to {nnz}), {len(col)} column indices for {nnz} values"
            )
        return crow, col, [rows, cols]


def _check_shape(shape: Any) -> None:
    if not isinstance(shape, list | tuple) or not all(
        isinstance(d, int | np.integer) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise ValueError(f"TensorData: shape must be a list of integers >= 0, got {shape!r}")


def _as_array(data: Any, np_dtype: type[np.generic]) -> np.ndarray:
    """``data`` as an array of ``np_dtype``. Values int64 cannot hold (inf/NaN, beyond
    +-2**63) are refused; fractions are truncated toward zero, as the official SDK does."""
    if isinstance(data, np.ndarray):
        arr = data
    else:
        try:
            arr = np.asarray(data)
        except (ValueError, OverflowError) as e:
            raise ValueError(f"TensorData: data must be a flat or rectangular list ({e})") from None
    if arr.dtype.kind not in "biuf":
        example = arr.ravel()[0] if arr.size else None
        raise ValueError(f"TensorData: data must hold numbers, got {arr.dtype} (e.g. {example!r})")
    if np_dtype is np.int64 and arr.dtype.kind in "uf":
        check_int64(arr, integral=False)
    if arr.dtype == np_dtype:
        # torch.from_numpy warns on read-only buffers (frombuffer, mmap, Arrow).
        return arr if arr.flags.writeable else arr.copy()
    with np.errstate(over="ignore"):  # 1e300 -> float32 inf: refused where values are checked
        return arr.astype(np_dtype)


_INT64_LIMIT = float(2**63)


def check_int64(
    arr: np.ndarray,
    *,
    integral: bool,
    what: str = "int64 TensorData",
    fix: str = "send whole numbers (token ids), or use dtype float32",
) -> None:
    """Raise ValueError unless every value of ``arr`` fits int64 (and, if ``integral``, is a
    whole number): converting it would otherwise fail or silently change it."""
    if arr.dtype.kind == "u":
        bad = arr > np.iinfo(np.int64).max
    elif arr.dtype.kind == "f":
        bad = ~np.isfinite(arr) | (arr >= _INT64_LIMIT) | (arr < -_INT64_LIMIT)
        if integral:
            bad |= np.isfinite(arr) & (arr != np.trunc(arr))
    else:
        return
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        kind = "a whole number" if integral else "a number"
        raise ValueError(
            f"{what}: value {arr.ravel()[i].item()!r} at flat index {i} is not {kind} in the "
            f"int64 range; {fix}"
        )


def _check_pad_value(pad_value: Any) -> int:
    # bool is an int subclass but almost always a mistake here.
    if isinstance(pad_value, bool) or not isinstance(pad_value, int | np.integer):
        raise TypeError(
            f"pad_value must be an integer, got {type(pad_value).__name__}: {pad_value!r}"
        )
    return int(pad_value)


def _numpy_dtype(dtype: Any) -> type[np.generic]:
    try:
        return _NUMPY_DTYPES[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"Unsupported TensorDtype: {dtype}") from None


def _tensor_dtype_of_numpy(dtype: np.dtype[Any]) -> TensorDtype:
    if dtype.kind == "f":
        return "float32"
    if dtype.kind == "i":
        return "int64"
    raise ValueError(f"Unsupported numpy dtype: {dtype}")


@contextmanager
def _quiet_csr_beta_warning() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Sparse CSR tensor support is in beta state")
        yield
