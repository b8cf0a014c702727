"""Prometheus metrics for aiohixl agents (the ``metrics`` extra: prometheus_client).

    from aiohixl.metrics import AgentCollector
    AgentCollector(agent).register()          # into prometheus_client's default REGISTRY

Each scrape reads ``agent.stats()`` (one native call, no lock) and reports, labelled by
agent and transport: ``aiohixl_ops_total``, ``aiohixl_bytes_total``, ``aiohixl_errors_total``;
by agent: ``aiohixl_notifications_received_total``, ``..._sent_total``, ``..._dropped_total``
and the gauge ``aiohixl_outstanding_ops``. A closed agent reports nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from .agent import Agent

__all__ = ["AgentCollector"]


class AgentCollector(Collector):
    """A collector for one or more agents; ``add``/``remove`` change which."""

    def __init__(self, *agents: Agent) -> None:
        self._agents: list[Agent] = list(agents)
        self._registry: CollectorRegistry | None = None

    def add(self, agent: Agent) -> None:
        self._agents.append(agent)

    def remove(self, agent: Agent) -> None:
        self._agents = [a for a in self._agents if a is not agent]

    def register(self, registry: CollectorRegistry = REGISTRY) -> AgentCollector:
        registry.register(self)
        self._registry = registry
        return self

    def unregister(self) -> None:
        if self._registry is not None:
            self._registry.unregister(self)
            self._registry = None

    def describe(self) -> list[Metric]:
        return list(self._families(with_samples=False))

    def collect(self) -> Iterator[Metric]:
        yield from self._families(with_samples=True)

    def _families(self, with_samples: bool) -> Iterator[Metric]:
        per = ["agent", "transport"]
        ops = CounterMetricFamily("aiohixl_ops", "Ops posted, per transport", labels=per)
        nbytes = CounterMetricFamily("aiohixl_bytes", "Bytes of the ops posted, per transport", labels=per)
        errors = CounterMetricFamily("aiohixl_errors", "Ops refused natively or failed, per transport", labels=per)
        received = CounterMetricFamily("aiohixl_notifications_received", "Notifications queued", labels=["agent"])
        sent = CounterMetricFamily("aiohixl_notifications_sent", "Notifications sent", labels=["agent"])
        dropped = CounterMetricFamily("aiohixl_notifications_dropped", "Notifications dropped", labels=["agent"])
        outstanding = GaugeMetricFamily("aiohixl_outstanding_ops", "Ops posted, not yet completed", labels=["agent"])
        if with_samples:
            for agent in list(self._agents):
                if agent.closed:
                    continue
                stats: dict[str, Any] = agent.stats()
                for name, t in stats["transports"].items():
                    ops.add_metric([agent.name, name], t["ops"])
                    nbytes.add_metric([agent.name, name], t["bytes"])
                    errors.add_metric([agent.name, name], t["errors"])
                notes = stats["notifications"]
                received.add_metric([agent.name], notes["received"])
                sent.add_metric([agent.name], notes["sent"])
                dropped.add_metric([agent.name], notes["dropped"])
                outstanding.add_metric([agent.name], stats["outstanding"])
        yield from (ops, nbytes, errors, received, sent, dropped, outstanding)
