"""Plumbing every process of a run shares: the run's key (`api_key`: one secret per run, by file or
environment, never on argv), addresses and free ports (`ports`), the process-group rendezvous with its
timeout (`rendezvous`), the collector during an entry point's start-up (`startup_heap`) and what an entry
point does right before its interpreter exits (`process_exit`). A library: it imports nothing of the package
outside this room.
"""
