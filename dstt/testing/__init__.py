"""Contract suites shipped with dstt: an outside implementation of one of
dstt's interfaces subclasses the suite and runs it under pytest (as zarr
ships ``zarr.testing.store.StoreTests``). Needs pytest; never imported by
dstt itself.

* :class:`dstt.testing.backends.BackendTests`: the backend contract
  (:class:`dstt.format.backends.Backend`).
* :class:`dstt.testing.storewatch.StoreWatch`: a c10d TCPStore served on
  127.0.0.1 and looked at while the helpers use it (what peer redundancy
  keeps in a job's store; tests and benchmarks).
"""
