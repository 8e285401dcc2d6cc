"""Collection sees the same registry as the ranks: the examples' algorithms and codecs."""
import plugins

plugins.load_all()
