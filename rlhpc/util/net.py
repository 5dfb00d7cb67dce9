"""Addresses in URLs: an IPv6 literal needs brackets, a host name or IPv4 address does not."""

from __future__ import annotations


def url_host(host: str) -> str:
    """``"::1"`` -> ``"[::1]"``; names, IPv4 and already bracketed hosts unchanged."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def http_url(host: str, port: int) -> str:
    return f"http://{url_host(host)}:{port}"


def tcp_url(host: str, port: int) -> str:
    """A ``torch.distributed`` init method URL."""
    return f"tcp://{url_host(host)}:{port}"
