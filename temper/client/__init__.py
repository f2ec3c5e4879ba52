"""In-process clients of the Tinker API: `ServiceClient`, `TrainingClient`, `SamplingClient`.

They build a trainer and a generator in this process and speak the contract in `temper.api`;
the HTTP server's backend is the same clients. Also here: weight sync between a trainer and
its sampling clients (weight_sync.py) and the sampler checkpoint format.
"""

from temper.client.sampling_client import SamplingClient
from temper.client.service_client import ServiceClient
from temper.client.training_client import TrainingClient

__all__ = ["SamplingClient", "ServiceClient", "TrainingClient"]
