"""The client: run a model whose blocks are served by the swarm (forward, backward, generate).

`AutoDistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=[...])` gives
the family's Hugging Face causal LM with its decoder layers on the swarm; ``generate``
works as usual (a `RemoteCache` stands for the remote session). With ``tuning_mode``
set, the model trains prompts through the swarm (`PromptTuning`); its LM head follows
the config's ``use_chunked_forward`` (`LMHead`). With ``verify_fraction`` set, independent
servers spot-check the results (`Verifier`; detections in ``model.verification_events``).
"""

from distconf.client.cache import RemoteCache
from distconf.client.lmhead import LMHead
from distconf.client.model import AutoDistributedModelForCausalLM, distributed_model_class
from distconf.client.ptune import PromptTuning
from distconf.client.sequence_manager import RetriesExhausted, SequenceManager
from distconf.client.sequential import RemoteSequential
from distconf.client.session import InferenceSession
from distconf.client.swarm import SwarmClient
from distconf.client.verifier import VerificationError, VerificationRollback, Verifier
from distconf.client.verify_events import VerificationEvent

__all__ = [
    "AutoDistributedModelForCausalLM", "InferenceSession", "LMHead", "PromptTuning", "RemoteCache", "RemoteSequential",
    "RetriesExhausted", "SequenceManager", "SwarmClient", "VerificationError", "VerificationEvent",
    "VerificationRollback", "Verifier", "distributed_model_class",
]
