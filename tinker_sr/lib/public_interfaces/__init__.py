"""Public client-facing interfaces (mirrors ``tinker.lib.public_interfaces``)."""

from tinker_sr.clients import (
    BackcompatSamplingClientFuture,
    BackcompatTrainingClientFuture,
    RestClient,
    SamplingClient,
    ServiceClient,
    TrainingClient,
)
from tinker_sr.clients.admin import AdminClient
from tinker_sr.clients.custom_loss import LossHandle, PerDatumLossFn
from tinker_sr.futures import APIFuture, AwaitableConcurrentFuture

__all__ = [
    "APIFuture",
    "AdminClient",
    "AwaitableConcurrentFuture",
    "BackcompatSamplingClientFuture",
    "BackcompatTrainingClientFuture",
    "LossHandle",
    "PerDatumLossFn",
    "RestClient",
    "SamplingClient",
    "ServiceClient",
    "TrainingClient",
]
