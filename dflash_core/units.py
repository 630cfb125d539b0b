"""Units of size. Sizes are counted in bytes everywhere; these turn them into what people read."""

GiB = 1 << 30
