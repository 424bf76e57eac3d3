"""The OpenAI Files and Batch APIs on JetStream: input-line validation, the batch state machine and
output-file assembly (pure), and the stores and coordinator that keep them in NATS."""
