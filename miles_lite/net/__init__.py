"""Plumbing every process of a run shares: the run's key (`api_key`: one secret per run, by file or
environment, never on argv), addresses and free ports (`ports`), the process-group rendezvous with its
timeout (`rendezvous`), the collector during an entry point's start-up (`startup_heap`) and what an entry
point does right before its interpreter exits (`process_exit`). A library: it imports nothing of the package
outside this room.
"""

# Every process of a run resolves host names from threads (engine readiness probes, the HTTP clients' resolver
# threads); getaddrinfo imports the idna codec on first use, and a first use in a thread while another thread
# imports can fail with "LookupError: unknown encoding: idna". Loaded with this package, before those threads.
import encodings.idna  # noqa: F401
