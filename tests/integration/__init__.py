"""Tests of flows that cross rooms or processes, each with the real thing on loopback.

A test belongs here when its subject is the path between rooms rather than one module:
several gateways or nodes sharing Redis (fleets), a request from client through gateway
and node to the ledger or the trace, `edgeserve up` and `edgeserve gateway` as processes,
a process SIGKILLed or a store taken away under load, the fault suite's smoke. A test of
one module, even one that needs Redis or a server on loopback, lives in
`tests/<room>/test_<module>.py` instead.
"""
