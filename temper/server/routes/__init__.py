"""The routes, one module per resource (sessions, training, sampling, futures, runs), as
module-level handlers that reach the server's state through the app (`request.app.state`)."""
