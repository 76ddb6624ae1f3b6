from typing import Literal, TypeAlias

__all__ = ["TensorDtype"]

TensorDtype: TypeAlias = Literal["int64", "float32"]
