"""EAGLE-3 draft heads: the head (:mod:`outrider.eagle.head`), its forward
over the draft worker's paged cache (:mod:`outrider.eagle.forward`), and
training one for any target (:mod:`outrider.eagle.train`)."""
