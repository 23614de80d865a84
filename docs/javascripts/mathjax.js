// MathJax 3 reads the \( \) and \[ \] spans that pymdownx.arithmatex (generic mode) writes; with instant loading
// (mkdocs-material's document$) each page is typeset again when it is shown.
window.MathJax = {
  tex: { inlineMath: [["\\(", "\\)"]], displayMath: [["\\[", "\\]"]], processEscapes: true },
  options: { processHtmlClass: "arithmatex", ignoreHtmlClass: ".*" },
};
if (typeof document$ !== "undefined") {
  document$.subscribe(() => {
    if (window.MathJax.typesetPromise) {
      window.MathJax.startup.output.clearCache();
      window.MathJax.typesetClear();
      window.MathJax.texReset();
      window.MathJax.typesetPromise();
    }
  });
}
