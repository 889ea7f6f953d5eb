"""Images in prompts: what every layer shares of a multimodal request (``inputs``), loading an image from a URL
or bytes within bounds (``media``), and turning images into the model's inputs with transformers' own image
processors (``processing``). Plain data and host code: no JAX, no model; the front end runs it on worker
threads and the engine carries its results (``ImageFeature``) to the runner."""
