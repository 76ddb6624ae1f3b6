"""Public clients: ServiceClient, TrainingClient, SamplingClient, RestClient."""

from tinker_sr.clients.creation import (
    BackcompatSamplingClientFuture,
    BackcompatTrainingClientFuture,
)
from tinker_sr.clients.rest import RestClient
from tinker_sr.clients.sampling import SamplingClient
from tinker_sr.clients.service import ServiceClient
from tinker_sr.clients.training import TrainingClient

__all__ = [
    "BackcompatSamplingClientFuture",
    "BackcompatTrainingClientFuture",
    "RestClient",
    "SamplingClient",
    "ServiceClient",
    "TrainingClient",
]
