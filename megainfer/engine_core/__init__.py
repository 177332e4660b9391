"""The engine core's side of the request route (docs/architecture.md, "The one route"): the
messages of every client <-> core boundary (``messages``), the core and its thread
(``core``), the builder of single and distributed engines (``builder``), this
process's place in an MPI launch (``launch_env``) and a child job's entry (``child_main``).
The clients are ``megainfer.core_client``'s."""
