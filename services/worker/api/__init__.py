"""The worker's surface: the gRPC servicer, the front end (the public port, in a process of its own,
started by frontend_process) and the link between the two processes (link: its framing and
message types; core_link: the core's end), the final responses built in one place (responses),
the chat template, structured output at admission (grammar: the grammars compiled for the served
tokenizer; structured: a request's matcher and the tool-call format), and the WatchResidency
feed."""
