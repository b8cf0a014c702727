"""Integrations of aiohixl into serving systems (``aiohixl.integrations.vllm``)."""
