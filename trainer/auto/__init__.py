"""parallel=auto: the layout search (candidates, their memory and step time, the choice)."""
