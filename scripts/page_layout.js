// Appended to a copy of a report page by check_report_in_browser.py: once the page and its images have
// loaded, it writes what Chromium laid out (the window's width, the page's, every image, table and
// text node with its box) as JSON into a pre element (id fxreplace-layout) that --dump-dom prints.
window.addEventListener("load", () => {
  const view = document.documentElement.clientWidth;
  const scrollingBox = (el) => {
    for (let p = el.parentElement; p; p = p.parentElement) {
      const overflow = getComputedStyle(p).overflowX;
      if (overflow === "auto" || overflow === "scroll") return p;
    }
    return null;
  };
  const out = {view, page: document.documentElement.scrollWidth, height: document.documentElement.scrollHeight,
               images: [], tables: [], beyond: [], texts: []};
  for (const img of document.images) {
    const r = img.getBoundingClientRect();
    out.images.push({src: img.getAttribute("src"), alt: img.alt, loaded: img.complete && img.naturalWidth > 0,
                     natural: img.naturalWidth, width: r.width, right: r.right});
  }
  for (const table of document.querySelectorAll("table")) {
    const box = scrollingBox(table);
    out.tables.push({id: table.id || null, rows: table.querySelectorAll("tr").length,
                     cells: table.querySelectorAll("td").length, width: table.scrollWidth,
                     box: box ? box.clientWidth : null, right: table.getBoundingClientRect().right});
  }
  for (const el of document.body.querySelectorAll("*")) {
    const r = el.getBoundingClientRect();
    if (r.width && r.right > view + 0.5 && !scrollingBox(el)) out.beyond.push(`${el.tagName} ${el.textContent.slice(0, 60)}`);
  }
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (!node.textContent.trim()) continue;
    const range = document.createRange();
    range.selectNodeContents(node);
    const r = range.getBoundingClientRect();
    out.texts.push({text: node.textContent.trim(), size: parseFloat(getComputedStyle(node.parentElement).fontSize),
                    width: r.width, right: r.right});
  }
  const pre = document.createElement("pre");
  pre.id = "fxreplace-layout";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
