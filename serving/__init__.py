"""serving: the HTTP front end (OpenAI protocol models, FastAPI routes, metrics) and the single-node
server. Imports `engine`, never `ray`. Built in the next slice (issue 3); empty until then.
"""
