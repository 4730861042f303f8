"""Per-token billing: usage events -> exactly-once ledger -> priced reports.

    events.py     UsageEvent, the one thing the gateway hands over (no money in it)
    sink.py       RedisUsageSink (stream + fsynced journal fallback), LocalUsageSink (in-process)
    journal.py    the gateway's local journal file
    worker.py     BillingWorker: consumer group -> ledger, ack after commit, XAUTOCLAIM
    ledger.py     Ledger: SqliteLedger (embedded), PostgresLedger (fleets); unique request id
    prices.py     PriceTable from TOML, versioned by effective date; Decimal money
    reports.py    per account x model x UTC day, priced per day; JSON, CSV, rich table
    reconcile.py  ledger vs stream and journals: gaps, in flight, awaiting replay
    http.py       GET .../ai/usage handler factory for the gateway
    errors.py     BillingError and its subclasses

Nothing is imported here, so `import billing.events` stays light on the gateway.
"""
