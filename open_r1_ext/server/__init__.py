"""The built-in server: SGLang 0.5.23's native HTTP protocol (and OpenAI's `/v1/completions`) on transformers.

`app` holds the HTTP routes and the command line (`python -m open_r1_ext.server`), `batcher` groups requests into
batches on one worker thread, `engine` runs the model. This side imports neither TRL nor DeepSpeed: a server node
needs only the server's dependencies.
"""
