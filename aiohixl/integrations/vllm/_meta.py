"""What the scheduler-side connector tells the worker-side one each step (plain, picklable data)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class Registration:
    """Decode side: blocks allocated for a transfer, to announce to the prefill worker."""

    transfer_id: str
    req_id: str
    first_block: int  # prompt blocks [0, first_block) are local prefix-cache hits
    block_ids: list[int]  # destination of prompt blocks first_block, first_block+1, ...
    num_prompt_tokens: int
    remote_engine_id: str | None


@dataclass
class Skip:
    """Decode side: the whole prompt hit the local prefix cache; the prefill worker pushes nothing."""

    transfer_id: str
    remote_engine_id: str | None


@dataclass
class SendStep:
    """Prefill side: a request with a decode destination computes prompt tokens this step."""

    req_id: str
    transfer_id: str
    block_ids: list[int]  # the request's whole block table
    num_computed: int  # tokens computed before this step
    num_scheduled: int
    num_prompt_tokens: int

    @property
    def final(self) -> bool:
        return self.num_computed + self.num_scheduled >= self.num_prompt_tokens


@dataclass
class AiohixlMetadata(KVConnectorMetadata):
    registrations: list[Registration] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    sends: list[SendStep] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)  # prefill side: transfer ids of aborted requests


@dataclass
class AiohixlWorkerMetadata(KVConnectorWorkerMetadata):
    """Prefill worker -> its scheduler: transfers whose decode blocks are now known (REG or SKIP)."""

    registered: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, AiohixlWorkerMetadata)
        return AiohixlWorkerMetadata(self.registered | other.registered)
