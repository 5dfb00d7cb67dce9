"""What crosses the wire between the driver, the actor's weight sender and the engines: SGLang's
native and OpenAI-compatible protocols written once, the HTTP client every caller uses, the
per-job engine key, tool-call parsing, and the request and abort types. Imported by both ends;
imports nothing of theirs."""
