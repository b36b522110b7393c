"""The worker's surface: the gRPC servicer, the front end (the public port, in a process of its own,
started by frontend_process) and the link between the two processes (link: its framing and
message types; core_link: the core's end), the final responses built in one place (responses),
the chat template, and the WatchResidency feed."""
